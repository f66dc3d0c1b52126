"""The top library layer, above evaluation and training, read by no DVC stage but the root check: the dev sweep
(`rcgrpo dev-sweep`: RL's levers tried through the pipeline's own stage commands, `run`, judged on the dev split,
`design`), the profiles (`profiles`: what each one runs, resolved through the stages' configs, beside the paper's
setup) and the whole params file checked at once (`params_check`: every stage's config class, the rules across
sections; the module the root stage `check_params` imports)."""
