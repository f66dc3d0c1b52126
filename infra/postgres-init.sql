-- The MLflow backend store lives beside Prefect's database in the same Postgres (compose path only).
CREATE DATABASE mlflow OWNER rcgrpo;
