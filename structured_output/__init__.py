"""Structured output plugins: grammar backends behind grammar_bitmask."""
