"""Tiny code-like texts shared by tests that train a throw-away tokenizer in-process."""

CODE_TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "for i in range(10):\n    print(i)\n",
    "import os\nimport sys\n",
    "while True:\n    break\n",
]
