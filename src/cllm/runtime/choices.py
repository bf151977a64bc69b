"""What a user may choose among that the runtimes define: the runtimes and the help text that
names them, GGUF weight types, llama.cpp's quantization types. Plain constants, no torch, so that
the config dataclasses of the commands can offer them without loading a runtime."""

RUNTIMES = ("auto", "transformers", "lean", "llamacpp")
RUNTIME_HELP = ("the forward the decoders run on: auto (a .gguf file: llamacpp; else the lean runtime where it runs "
                "the model, the Llama family in float32, bfloat16 or float16; else transformers'), transformers (the "
                "model's own forward), lean, or llamacpp (llama.cpp on a GGUF file, a model folder exported once "
                "into ~/.cache/cllm/gguf; needs cllm[llamacpp])")

# `cllm export --out-type`: the weight types `gguf` writes (`gguf.OUT_TYPES` maps them to torch's dtypes)
GGUF_OUT_TYPES = ("f32", "f16", "bf16")
# `cllm export --quantize` types: llama.cpp's own quantizer, by the names its llama-quantize takes
QUANT_TYPES = {"q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q6_k": 18, "q5_k_m": 17, "q4_k_m": 15,
               "q4_k_s": 14, "q3_k_m": 12, "q2_k": 10, "f16": 1, "bf16": 32}
