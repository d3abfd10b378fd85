"""Transport between front end and engine: the request ring and output channels in shared memory."""
