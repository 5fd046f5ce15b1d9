"""The hybrid-parallel runtime resihp reshapes: the reference GPT and its tensor-parallel
layers, the 1F1B pipeline, the process groups of a plan epoch, data, timing and the resilient loop.

Entry points: ``Runtime`` / ``TrainConfig`` (trainer), ``Resilience`` (resilient), ``make_groups``
(groups), ``GlobalBatches`` (data), ``gpt_tensor_specs`` (layout: pure), ``clock_for`` (chunk_clock).
"""
