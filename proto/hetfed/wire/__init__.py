"""The hetfed wire package: typed payloads, the tensor codec, chunking, contracts and traffic metrics."""
