# MLflow tracking server for infra/docker-compose.yml: Postgres backend, S3 artifacts (proxied).
FROM ghcr.io/mlflow/mlflow:v3.17.2
RUN pip install --no-cache-dir psycopg2-binary boto3
