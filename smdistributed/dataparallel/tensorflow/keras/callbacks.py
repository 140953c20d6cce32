"""smdistributed.dataparallel.tensorflow.keras.callbacks: smddp's Keras callbacks."""

from smddp.tensorflow.keras.callbacks import BroadcastGlobalVariablesCallback, MetricAverageCallback

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback"]
