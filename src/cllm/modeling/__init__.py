"""Model-side pieces for training: the losses, the training forwards, Medusa heads, named shapes."""
