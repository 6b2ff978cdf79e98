"""Tags belong to their users, modules are shared by id, and each user's uploads are capped
(services/controller_runtime/registry.py 'Ownership', 'Quotas')."""

from __future__ import annotations

import json

import pytest

from common.config import Tenants
from common.errors import RATE_LIMITED
from common.quotas import QuotaExceeded
from common.wire import Principal
from services.controller_runtime.registry import ModuleRegistry, RegistryError
from tests.controller_runtime.wat import controller

ALICE, BOB, ADMIN = Principal(user="alice"), Principal(user="bob"), Principal(user="root", admin=True)


@pytest.fixture
def registry(tmp_path, engine) -> ModuleRegistry:
    return ModuleRegistry(tmp_path / "modules", engine)


def test_a_users_tag_is_theirs_and_an_admins_is_everyones(registry: ModuleRegistry):
    module_id = registry.create(controller(), "alice")["module_id"]
    registry.set_tags(module_id, ["alice.mine"], ALICE)
    registry.set_tags(module_id, ["catalogue"], ADMIN)
    assert [t["tag"] for t in registry.get_tags(ALICE)] == ["alice.mine", "catalogue"]
    assert [t["tag"] for t in registry.get_tags(BOB)] == ["catalogue"]
    assert [t["tag"] for t in registry.get_tags(ADMIN)] == ["alice.mine", "catalogue"]
    assert registry.resolve("alice.mine", ALICE)[0] == module_id
    assert registry.resolve("alice.mine", ADMIN)[0] == module_id
    assert registry.resolve("catalogue", BOB)[0] == module_id
    with pytest.raises(RegistryError) as hidden:
        registry.resolve("alice.mine", BOB)
    with pytest.raises(RegistryError) as unknown:
        registry.resolve("alice.never", BOB)
    assert str(hidden.value) == str(unknown.value).replace("never", "mine")  # no hint the tag exists
    assert registry.resolve(module_id, BOB)[0] == module_id  # the module itself is shared by its id


def test_only_its_owner_or_an_admin_moves_a_tag(registry: ModuleRegistry):
    first = registry.create(controller(), "alice")["module_id"]
    second = registry.create(controller(pages=3), "root")["module_id"]
    registry.set_tags(first, ["alice.t"], ALICE)
    registry.set_tags(second, ["bob.t"], ADMIN)  # an admin made it: it is public, and the admin's
    with pytest.raises(RegistryError, match="belongs to another user"):
        registry.set_tags(first, ["bob.t"], BOB)
    registry.set_tags(second, ["alice.t"], ADMIN)  # an admin moves anyone's; the owner stays
    assert [t["tag"] for t in registry.get_tags(BOB)] == ["bob.t"]
    assert registry.resolve("alice.t", ALICE)[0] == second


def test_tags_stored_before_owners_stay_public(tmp_path, engine):
    registry = ModuleRegistry(tmp_path / "modules", engine)
    module_id = registry.create(controller(), "alice")["module_id"]
    (tmp_path / "modules" / "tags.json").write_text(json.dumps(
        {"alice.old": {"module_id": module_id, "updated_at": 1, "updated_by": "alice"}}))
    reopened = ModuleRegistry(tmp_path / "modules", engine)
    assert reopened.resolve("alice.old", BOB)[0] == module_id
    assert [t["tag"] for t in reopened.get_tags(BOB)] == ["alice.old"]
    reopened.set_tags(module_id, ["alice.old"], ALICE)  # its setter (updated_by) owns it
    assert reopened.resolve("alice.old", BOB)[0] == module_id  # and it stays public


def test_a_users_modules_and_their_bytes_are_capped(tmp_path, engine):
    small, other, third = controller(), controller(pages=3), controller(pages=4)
    limits = Tenants(max_modules_per_user=2, max_module_bytes_per_user=len(small) + len(other))
    registry = ModuleRegistry(tmp_path / "modules", engine, limits)
    registry.create(small, "alice")
    registry.create(small, "alice")  # uploading it again costs nothing
    registry.create(other, "alice")
    with pytest.raises(QuotaExceeded, match="holds 2 controller modules; 1 more would pass "
                                            "tenants.max_modules_per_user = 2") as refused:
        registry.create(third, "alice")
    assert refused.value.code == RATE_LIMITED
    registry.create(small, "bob")  # alice's module counts for bob too once he uploads it
    with pytest.raises(QuotaExceeded, match="tenants.max_module_bytes_per_user"):
        bytes_only = ModuleRegistry(tmp_path / "modules", engine, Tenants(max_module_bytes_per_user=len(small)))
        bytes_only.create(other, "bob")


def test_a_user_whose_name_begins_another_users_neither_takes_nor_learns_of_their_tags(registry: ModuleRegistry):
    module_id = registry.create(controller(), "a.b")["module_id"]
    registry.set_tags(module_id, ["a.b.x"], Principal(user="a.b"))
    refusals = []
    for tag in ("a.b.x", "a.b.never"):  # set, and never set: told the same
        with pytest.raises(RegistryError) as refused:
            registry.set_tags(module_id, [tag], Principal(user="a"))
        refusals.append(str(refused.value).replace(tag, "TAG"))
    assert refusals[0] == refusals[1] and "no other dot" in refusals[0]
    registry.set_tags(module_id, ["a.mine"], Principal(user="a"))


def test_uploads_at_once_cannot_pass_the_quota_together(tmp_path, engine):
    """Each upload compiles in a worker thread: the quota is checked and reserved in one step."""
    import threading

    limits = Tenants(max_modules_per_user=2)
    registry = ModuleRegistry(tmp_path / "modules", engine, limits)
    modules = [controller(pages=p) for p in (2, 3, 4, 5, 6)]
    outcomes: list[str] = []
    start = threading.Barrier(len(modules))

    def upload(wasm: bytes) -> None:
        start.wait()
        try:
            registry.create(wasm, "alice")
            outcomes.append("stored")
        except QuotaExceeded:
            outcomes.append("refused")

    threads = [threading.Thread(target=upload, args=(m,)) for m in modules]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["refused"] * 3 + ["stored"] * 2, outcomes
    same = controller(pages=7)  # one module uploading twice at once counts once
    both = [threading.Thread(target=registry.create, args=(same, "bob")) for _ in range(2)]
    for t in both:
        t.start()
    for t in both:
        t.join()
    assert json.loads((tmp_path / "modules" / "meta" / f"{registry.create(same, 'bob')['module_id']}.json")
                      .read_text())["uploaded_by"] == ["bob"]
