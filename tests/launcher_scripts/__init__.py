"""Small programs and helpers the launcher tests start as real processes."""
