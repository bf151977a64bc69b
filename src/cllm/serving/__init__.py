"""Text in, text out: completions (`completion`), the decode options and model loading that
`cllm generate` / `cllm chat` / `cllm serve` share (`options`, `loading`), chat history
(`history`), and the OpenAI-compatible server: request checking (`api`), continuous batching
(`scheduler`), the request-to-scheduler bridge (`service`), its settings (`config`) and the
HTTP app (`app`); `hf_generate` plugs Jacobi decoding into transformers' `generate`."""
