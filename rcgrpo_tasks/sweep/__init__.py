"""The dev sweep (`rcgrpo dev-sweep`): RL's levers tried through the pipeline's own stage commands (`run`) and
judged on the dev split (`design`). Above evaluation and training, and read by no DVC stage."""
