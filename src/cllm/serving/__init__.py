"""Text in, text out: completions, the OpenAI API, continuous batching, the HTTP app."""
