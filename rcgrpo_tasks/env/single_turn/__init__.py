"""BFCL v4 single-turn, the AST categories: entries and prompt docs (`entries`), the one-output episode
(`episode`), BFCL's AST checker (`ast_check`, `ast_values`), result-file scoring (`scoring`), expert answers
and near misses (`perturb`), and the task itself (`task.TASK`, registered in `env.tasks`)."""
