"""BFCL v4 multi-turn, the paper's task: entries (`entries`), the isolated environment (`environment`,
`calls`), the episode under both protocols (`episode`), the scorer (`scoring`), near-miss perturbations
(`perturb`), result-file decoding (`decode`), and the task itself (`task.TASK`, registered in `env.tasks`)."""
