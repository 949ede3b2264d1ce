"""The engine core (Part II): blocks, the KV-cache manager, the scheduler, the paged cache, the model
runner, the output processor and the loop that ties them together. Nothing here imports the speed
code, the server, the pictures or the benchmark, not even inside a function (a test checks it): the
runner gets the speed code through one factory (``ModelRunner.speed_factory``)."""
