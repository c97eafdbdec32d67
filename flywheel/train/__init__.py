"""Model and tokenizer loading, the tiny demo student, SFT and RL."""
