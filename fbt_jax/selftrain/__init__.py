"""`fbt-self-train`: rounds of sampling a run's answers, keeping its shortest correct ones and tuning on them."""
