"""The per-token fields (Batch.fields) that the step's objectives and the reference policy read or write by name:
data/ moves them without naming them; train/reference.py writes REFERENCE, train/grpo.py and train/dpo.py read them."""

ADVANTAGE, BEHAVIOUR, REFERENCE = "advantage", "logprobs", "ref_logprobs"
