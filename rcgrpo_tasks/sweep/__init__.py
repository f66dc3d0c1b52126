"""The top library layer, above evaluation and training: the dev sweep (`rcgrpo dev-sweep`: RL's levers tried
through the pipeline's own stage commands, `run`, judged on the dev split, `design`) and the whole params file
checked at once (`params_check`: every stage's config class, the rules across sections; the only module here a
DVC stage imports: the root stage `check_params`)."""
