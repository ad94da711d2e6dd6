"""Speculative decoding: drafters and draft-length scheduling."""
