"""`cllm bench`: every decoding method on the same prompts, timed and checked, and its report."""
