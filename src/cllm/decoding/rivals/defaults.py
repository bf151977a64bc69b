"""The tree decoders' defaults (`medusa`, `eagle`): plain numbers, no torch, so that the configs
of the commands that train their heads offer them without loading the decoders."""

MEDUSA_NODES = 20  # tree nodes verified per forward besides the root (a CPU pays for each)
MEDUSA_TOP_K = 8  # ranks a built tree considers per head

EAGLE_NODES = 4  # draft tokens verified per forward besides the root
EAGLE_DEPTH = 3  # draft levels: the head runs this many forwards per step
EAGLE_TOP_K = 4  # children per expanded node, and nodes expanded per level
