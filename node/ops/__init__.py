"""Operations: the service that wires the node together, the command line, metrics, notifications
and retention. It owns process lifetime and the operator's commands.
"""
