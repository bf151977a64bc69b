"""The paper's rivals on the same caches: speculative decoding with a draft model, Medusa heads."""
