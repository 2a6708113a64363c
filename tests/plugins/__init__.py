"""Users' plug-ins as a job names them (``module:function``), for the tests that run them."""
