"""Tensor kernels, each with its plain reference beside it: exact paged attention with a
log-sum-exp merge (`paged_attention`), the chunked gated delta rule (`gdn`), absorbed MLA
attention (`latent_attention`), DeepSeek sparse-attention top-k (`dsa_topk`, Triton scores in
`dsa_topk_triton`), chunked log-probs (`logprobs`), and kernel rate probes (`rates`)."""
