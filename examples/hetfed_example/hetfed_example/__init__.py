"""An organization's own code for hetfed: encoder builders (models) and a data factory (data), plain PyTorch."""
