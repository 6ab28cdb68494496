"""The transaction: capture, score, replay (`transaction`), the exact prompt-side gradient
(`exact`), the GRPO objective (`grpo`) and one GRPO step (`step`); HF's own computations as the
independent references (`hf_reference`)."""
