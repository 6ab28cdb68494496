"""Kind `capture`: capture only; time, positions/s, resident bytes against the prediction and the
transient memory (peak minus what was there before minus the resident state), then one timed
replay (forward + backward) of a response of `responses.length`."""

from __future__ import annotations

from longstraw.config import PointConfig
from longstraw.core.transaction import replay
from longstraw.kinds.common import Progress, measure_capture, policy_and_prompt, seeded_tokens
from longstraw.measure.memory import PhaseRecorder


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    recorder = PhaseRecorder(device)
    model, vocab, prompt = policy_and_prompt(cfg, recorder)
    metrics, state = measure_capture(model, prompt, cfg, recorder)
    response = seeded_tokens(cfg.responses.length, cfg.responses.seed, vocab, device)
    with recorder.phase("replay"):
        replay(model, state, response).sum().backward()
    return {"phases": recorder.phases, **metrics, "replay_seconds": recorder.phases["replay"]["seconds"],
            "response_length": int(response.numel())}
