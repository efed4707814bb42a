"""The job pipeline: the worker (volume -> engine -> SEG + SR files -> outbox rows), the engine
pool and the thread helpers. It owns a job from claim to 'encoded'; it must not speak DICOM on
the network.
"""
