"""Data: the embedded stdlib corpus, its tokenizer, prompt sets and trajectory records."""
