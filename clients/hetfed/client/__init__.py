"""The hetfed client runtime: organization config, data, private models and client halves of algorithms."""
