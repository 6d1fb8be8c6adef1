"""tandem simulate: the real plugin stack on a virtual clock."""
