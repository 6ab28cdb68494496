"""Task-competent models without a hub: pretrain small presets from random initialisation on the
synthetic long-context tasks (`pretrain`), then measure where they break with prompt length
(`length_curve`)."""
