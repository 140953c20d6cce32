"""smdistributed: SageMaker's package name, a thin alias over smddp so SageMaker scripts run unchanged."""
