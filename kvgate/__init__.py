"""The ``kvgate`` command's composition root: the one package that may import every other."""
