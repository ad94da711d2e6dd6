"""Speculative decoding under vLLM: the V4 MTP drafter (`mtp.py`), the V4.1 DSpark drafter (`dspark.py`)
with its V1 proposer (`dspark_proposer.py`), the draft-length policy of confidence-scheduled verification
(`schedule.py`) and the MTP drafter's V1-runner wiring (`proposer.py`)."""
