"""A module that cannot be imported."""

raise ImportError("libcudnn.so.9: cannot open shared object file")
