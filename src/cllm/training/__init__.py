"""Making a CLLM: trajectory collection, consistency training, distillation, pretraining, heads."""
