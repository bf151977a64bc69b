"""What a decoding step costs on this machine, and the decode defaults that follow from it."""
