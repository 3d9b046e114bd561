"""Adapters that put opmesh's operators under other libraries' extension points."""
