"""Synthetic wrap targets (staticmethod, classmethod, inherited, plain, a
module function) for tests/patching/test_patch_engine.py: its fixture runs
this file's source in a module of a fresh name for each test, so no two
tests share one."""


class Base:
    def inherited(self, ubatch_idx=0, **kwargs):
        return ("inherited", ubatch_idx)


class Target(Base):
    @staticmethod
    def static(ubatch_idx=0, **kwargs):
        return ("static", ubatch_idx)

    @classmethod
    def klass(cls, ubatch_idx=0, **kwargs):
        return ("klass", cls.__name__, ubatch_idx)

    def plain(self, ubatch_idx=0, **kwargs):
        return ("plain", ubatch_idx)


class Sub(Target):
    pass


def free(ubatch_idx=0, **kwargs):
    return ("free", ubatch_idx)
