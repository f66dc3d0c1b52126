"""Designs compared: the dev sweep (`rcgrpo dev-sweep`: RL's levers tried through the pipeline's own stage
commands, `run`, judged on the dev split, `design`) and the profiles (`profiles`: what each one runs, resolved
through the stages' configs, beside the paper's setup). Above evaluation and training, and read by no DVC stage."""
