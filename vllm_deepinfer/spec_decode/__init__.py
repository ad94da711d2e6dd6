"""Speculative decoding under vLLM: the V4 MTP drafter (`mtp.py`), the draft-length policy of
confidence-scheduled verification (`schedule.py`) and its V1-runner wiring (`proposer.py`)."""
