"""cllm: Consistency Large Language Models."""
__version__ = "0.1.0"
