"""``python -m lstmem_peft.cli.demo build`` remakes the shipped backbone and adapters and prints their
record (:func:`.training.build`); ``... publish`` re-saves the shipped adapters with their cards
(:func:`.training.publish`)."""

from __future__ import annotations

import json
import sys

from .training import build, publish

if sys.argv[1:2] == ["build"]:
    print(json.dumps(build(), indent=2))
elif sys.argv[1:2] == ["publish"]:
    publish()
