"""Operations: the MLflow registry, the serving config, target versions, Prometheus metrics,
acceptance monitoring with its fallback, and the drift scenario."""
