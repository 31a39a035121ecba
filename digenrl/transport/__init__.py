"""ZeroMQ transport: codec (codec.py, schema.py), sockets (sockets.py,
socketio.py, options.py, endpoints.py), CurveZMQ (curve.py).

Import the submodules directly; this package imports nothing so that
:mod:`digenrl.transport.protocol` can build on ``codec`` without an import cycle.
"""
