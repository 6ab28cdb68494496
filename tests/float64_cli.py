"""The CLI (`python -m longstraw ...`) with one preset's HF float32 casts and the GDN states in float64
(float64_reference), for float64 points launched in fresh processes (torchrun's workers), where the tests'
patches do not reach: `python -m float64_cli tiny-llama run POINT.yaml --out R.json`."""

import sys

from float64_reference import float64_gdn_states, hf_float64_for

from longstraw.cli import main

if __name__ == "__main__":
    preset, *argv = sys.argv[1:]
    with hf_float64_for(preset), float64_gdn_states():
        sys.exit(main(argv))
