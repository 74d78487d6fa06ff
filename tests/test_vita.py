"""VitaBench: loader, deterministic tool env, order-state proxy score (data in ../shared/data/vitabench)."""
import copy
import json
import random

import pytest

from bench import BenchUnavailable, Trajectory
from bench import vita

if not vita.DEFAULT_DATA.is_dir():
    pytest.skip(f"VitaBench data not found at {vita.DEFAULT_DATA}", allow_module_level=True)


@pytest.fixture(scope="module")
def tasks():
    return {(d, l): vita.load_tasks("test", domain=d, lang=l) for d, l in
            [("delivery", "en"), ("delivery", "zh"), ("instore", "en")]}


def _traj(task, calls, observations=None):
    return Trajectory(task_id=task.id, messages=[], calls=calls, observations=observations or [])


def test_available_domains_and_counts(tasks):
    assert vita.available_domains() == {"delivery": ["en", "zh"], "instore": ["en"]}
    assert {k: len(v) for k, v in tasks.items()} == {("delivery", "en"): 100, ("delivery", "zh"): 100,
                                                     ("instore", "en"): 100}
    assert len(vita.load_tasks("test", domain="all")) == 200
    assert len(vita.load_tasks("test", limit=3)) == 3


def test_bad_options(tmp_path):
    with pytest.raises(ValueError, match="delivery, instore, all"):
        vita.load_tasks("test", domain="airline")
    with pytest.raises(ValueError, match="en, zh"):
        vita.load_tasks("test", lang="fr")
    with pytest.raises(ValueError, match="split"):
        vita.load_tasks("validation")
    with pytest.raises(BenchUnavailable, match="--data"):
        vita.load_tasks("test", domain="instore", lang="zh")
    with pytest.raises(BenchUnavailable, match="--data"):
        vita.load_tasks("test", data=tmp_path / "nowhere")
    (tmp_path / "delivery").mkdir()
    (tmp_path / "delivery" / "tasks_en.json").write_text("[{not json")
    assert vita.available_domains(tmp_path) == {"delivery": ["en"]}
    with pytest.raises(ValueError, match="not valid JSON"):
        vita.load_tasks("test", domain="delivery", data=tmp_path)


def test_splits_partition():
    train = {t.id for t in vita.load_tasks("train", domain="all")}
    dev = {t.id for t in vita.load_tasks("dev", domain="all")}
    assert train and dev and not (train & dev) and len(train | dev) == 200


def test_task_shape(tasks):
    t = tasks[("delivery", "en")][0]
    assert [m["role"] for m in t.messages] == ["system", "user"]
    assert "Current time: 2025-06-21 11:20:00 Saturday" in t.messages[0]["content"]
    assert "###STOP###" in t.messages[0]["content"]
    assert "rice noodles" in t.messages[1]["content"] and "U000001" in t.messages[1]["content"]
    names = [s["function"]["name"] for s in t.tools]
    assert len(names) == len(set(names)) and "create_delivery_order" in names and "instore_book" not in names
    for s in t.tools:
        assert s["type"] == "function" and s["function"]["parameters"]["type"] == "object"
    zh = tasks[("delivery", "zh")][0]
    assert "当前时间" in zh.messages[0]["content"] and "星期六" in zh.messages[0]["content"]
    ins = tasks[("instore", "en")][0]
    assert "instore_reservation" in [s["function"]["name"] for s in ins.tools]
    chat = vita.load_tasks("test", domain="delivery", limit=1, mode="chat")[0]
    assert "ask the user" in chat.messages[0]["content"]


def test_ground_truth_replay_scores_one(tasks):
    derived = {}
    for key, ts in tasks.items():
        n = 0
        for t in ts:
            calls, problems = vita.reference_calls(t)
            s = vita.score(t, _traj(t, calls))
            assert 0.0 <= s.reward <= 1.0 and s.components["metric"] == "order_state_proxy"
            if not problems:
                n += 1
                assert s.reward == 1.0, (t.id, s.components)
                assert s.components["replay_errors"] == 0
        derived[key] = n
    # the rest are data defects (product or shop missing from the task's database, booking not enabled)
    assert derived == {("delivery", "en"): 97, ("delivery", "zh"): 97, ("instore", "en"): 96}


def _first_create(calls, name):
    return next(i for i, c in enumerate(calls) if c.name == name)


def test_corrupted_calls_score_lower(tasks):
    t = tasks[("delivery", "en")][0]            # one order: 1 x product P88296 from one store, paid
    calls, problems = vita.reference_calls(t)
    assert not problems and vita.score(t, _traj(t, calls)).reward == 1.0
    i = _first_create(calls, "create_delivery_order")

    wrong_qty = copy.deepcopy(calls)
    wrong_qty[i].arguments["product_cnts"] = [3]
    s = vita.score(t, _traj(t, wrong_qty))
    assert s.reward == pytest.approx(0.75)      # store, products, status right; quantity wrong

    unpaid = calls[:i + 1]                      # created but never paid
    assert vita.score(t, _traj(t, unpaid)).reward == pytest.approx(0.75)

    assert vita.score(t, _traj(t, [])).reward == 0.0       # missing order

    twice = calls + calls                       # a second, unrequested active order
    assert vita.score(t, _traj(t, twice)).reward == pytest.approx(0.5)

    # wrong product: another task with several products in the chosen store
    for t2 in tasks[("delivery", "en")]:
        calls2, problems2 = vita.reference_calls(t2)
        j = next((k for k, c in enumerate(calls2) if c.name == "create_delivery_order"), None)
        if problems2 or j is None:
            continue
        store = t2.metadata["environment"]["stores"][calls2[j].arguments["store_id"]]
        others = [p["product_id"] for p in store["products"] if p["product_id"] not in calls2[j].arguments["product_ids"]]
        if others and len(calls2[j].arguments["product_ids"]) == 1:
            bad = copy.deepcopy(calls2)
            bad[j].arguments["product_ids"] = [others[0]]
            s = vita.score(t2, _traj(t2, bad))
            assert s.reward < 1.0 and s.components["n_exact"] < s.components["n_required"]
            break
    else:
        pytest.fail("no task with an alternative product found")


def test_instore_corrupted_and_cancel(tasks):
    t = next(t for t in tasks[("instore", "en")] if not vita.reference_calls(t)[1]
             and any(c.name == "instore_reservation" for c in vita.reference_calls(t)[0]))
    calls, _ = vita.reference_calls(t)
    k = _first_create(calls, "instore_reservation")
    bad = copy.deepcopy(calls)
    bad[k].arguments["customer_count"] = bad[k].arguments["customer_count"] + 1
    assert vita.score(t, _traj(t, bad)).reward < 1.0
    assert vita.score(t, _traj(t, [c for n, c in enumerate(calls) if n != k])).reward < 1.0


def test_malformed_calls_are_error_observations(tasks):
    t = tasks[("delivery", "en")][0]
    env = vita.make_env(t)
    bad = [
        ("get_delivery_store_info", {}),
        ("get_delivery_store_info", {"store_id": "S85277471199200385_S98778", "extra": 1}),
        ("no_such_tool", {}),
        ("get_delivery_store_info", "not a dict"),
    ]
    for name, args in bad:
        out = env.step(name, args)
        assert isinstance(out, str) and out.startswith("Error"), (name, args, out)
    rng = random.Random(0)
    values = [None, 1, 1.5, "x", [], ["x"], [1], {}, True, "2025-13-45 99:99:99"]
    for spec in t.tools + tasks[("instore", "en")][0].tools:
        props = spec["function"]["parameters"]["properties"]
        for _ in range(5):
            args = {k: rng.choice(values) for k in props}
            assert isinstance(env.step(spec["function"]["name"], args), str)
    assert env.db["orders"] == {}      # nothing got created by bad calls


# Wrongly typed arguments, answered as VitaBench's own tools answer them (github.com/meituan-longcat/vitabench,
# src/vita). Upstream's tools get the raw JSON values with no type check. Its environment
# (environment/environment.py, Environment.get_response) answers a tool that raises with f"Error: {e}"; an
# `assert` that fails is caught by the tool wrapper (environment/toolkit.py, is_tool: `except AssertionError
# as e: return str(e)`) and comes back as its bare message, which our environment prefixes with "Error: "
# like every refusal of ours. Each expectation below was read off the upstream line in its comment (and
# checked by running upstream's tools on the same task database). Pydantic errors are shown without
# pydantic's version-specific "For further information visit ..." lines.
D = dict(user_id="U000001", store_id="S85277471199200385_S98778", product_ids=["S26110520013660896_P88296"],
         product_cnts=[1], dispatch_time="2025-06-21 11:30:00")          # delivery task 0 (address added below)
I = dict(user_id="U216378", shop_id="S17564420247526245_I00002")        # in-store task 1 (booking costs 30)
I_T = "2025-05-09 18:00:00"
PYD_INT = "Input should be a valid integer, got a number with a fractional part [type=int_from_float, input_value=1.5, input_type=float]"

UPSTREAM_TYPES = [
    # --- generic tools (environment/toolkit.py, ToolKitBase) ---
    # longitude_latitude_to_distance: `map(math.radians, [longitude1, ...])` on the raw values
    ("delivery", "longitude_latitude_to_distance", dict(longitude1="102.7", latitude1=25, longitude2=102, latitude2=25),
     "Error: must be real number, not str"),
    # ... but first `if longitude1 == longitude2 and latitude1 == latitude2: return 0.0`, strings included
    ("delivery", "longitude_latitude_to_distance", dict(longitude1="1", latitude1="2", longitude2="1", latitude2="2"), "0.0"),
    ("delivery", "longitude_latitude_to_distance", dict(longitude1=[1], latitude1=2, longitude2=3, latitude2=4),
     "Error: must be real number, not list"),
    # weather: `assert check_time_format(date_start, "%Y-%m-%d")`; check_time_format catches only ValueError
    ("delivery", "weather", dict(address="Kunming", date_start=20250621, date_end="2025-06-21"),
     "Error: strptime() argument 1 must be str, not int"),
    # weather: `rerank(address, ...)` = thefuzz process.extract, whose processor refuses a non-string query
    ("delivery", "weather", dict(address=42, date_start="2025-06-21", date_end="2025-06-21"),
     "Error: sentence must be a String"),
    # address_to_longitude_latitude: `rerank(address, address_lng_lat_dict_for_rerank, True)`
    ("delivery", "address_to_longitude_latitude", dict(address=["Kunming"]), "Error: sentence must be a String"),
    # get_date_holiday_info: `assert check_time_format(date, "%Y-%m-%d")`
    ("delivery", "get_date_holiday_info", dict(date=20251003), "Error: strptime() argument 1 must be str, not int"),
    # get_holiday_date: `if year not in holiday_data: return f"Holiday data for year {year} not found"` (str keys)
    ("delivery", "get_holiday_date", dict(year=2025, holiday_name="Mid-Autumn Festival"), "Holiday data for year 2025 not found"),
    ("delivery", "get_holiday_date", dict(year=["2025"], holiday_name="Mid-Autumn Festival"), "Error: unhashable type: 'list'"),
    # get_holiday_date: `process.extract(holiday_name, holiday_names, ...)`
    ("delivery", "get_holiday_date", dict(year="2025", holiday_name=5), "Error: sentence must be a String"),
    # get_nearby: `self.longitude_latitude_to_distance(longitude, latitude, ...)`, then `if distance <= range`
    ("delivery", "get_nearby", dict(longitude="102.7", latitude=25.0, range=5000), "Error: must be real number, not str"),
    ("instore", "get_nearby", dict(longitude=102.7, latitude=25.0, range="5000"),
     "Error: '<=' not supported between instances of 'float' and 'str'"),
    # --- delivery (domains/delivery/tools.py, DeliveryTools) ---
    # delivery_distance_to_time: `assert isinstance(distance, float) or isinstance(distance, int), f"distance value
    # type should be float or int, but get {type(distance)}"` -- a string is refused, not converted
    ("delivery", "delivery_distance_to_time", dict(distance="1000"),
     "Error: distance value type should be float or int, but get <class 'str'>"),
    # ... a bool passes isinstance(..., int): `round(25.00 + int(distance) * 0.006510, 0)`
    ("delivery", "delivery_distance_to_time", dict(distance=True), "25.0"),
    # get_delivery_store_info: _get_store: `if store_id not in self.db.stores.keys(): raise ValueError(...)`
    ("delivery", "get_delivery_store_info", dict(store_id=42), "Error: Store 42 not found"),
    ("delivery", "get_delivery_store_info", dict(store_id=["S85277471199200385_S98778"]), "Error: unhashable type: 'list'"),
    # get_delivery_product_info: _get_store_product: `raise ValueError(f"{product_id} not found")`
    ("delivery", "get_delivery_product_info", dict(product_id=42), "Error: 42 not found"),
    # delivery_store_search_recommand / delivery_product_search_recommand: `rerank("".join(keywords), ...)`
    ("delivery", "delivery_store_search_recommand", dict(keywords=5), "Error: can only join an iterable"),
    ("delivery", "delivery_product_search_recommand", dict(keywords=["x", 2]),
     "Error: sequence item 1: expected str instance, int found"),
    # create_delivery_order: `assert len(product_ids) == len(product_cnts) and all([cnt > 0 for cnt in product_cnts])`
    ("delivery", "create_delivery_order", dict(D, product_cnts=["2"]),
     "Error: '>' not supported between instances of 'str' and 'int'"),
    ("delivery", "create_delivery_order", dict(D, product_cnts=2), "Error: object of type 'int' has no len()"),
    # ... a string of length 1 is iterated: "2" > 0
    ("delivery", "create_delivery_order", dict(D, product_cnts="2"),
     "Error: '>' not supported between instances of 'str' and 'int'"),
    # ... `StoreProduct(..., quantity=cnt, ...)`: pydantic `quantity: Optional[int]` refuses 1.5
    ("delivery", "create_delivery_order", dict(D, product_cnts=[1.5]), "Error: 1 validation error for StoreProduct\nquantity\n  " + PYD_INT),
    # create_delivery_order: `all([self._get_store_product(product_id) is not None for product_id in product_ids])`:
    # a string is iterated letter by letter and _get_store_product raises "S not found"
    ("delivery", "create_delivery_order", dict(D, product_ids="S26110520013660896_P88296"), "Error: S not found"),
    ("delivery", "create_delivery_order", dict(D, product_ids=5), "Error: 'int' object is not iterable"),
    # create_delivery_order: `assert self._check_user(user_id), "User ID does not match"` (user_id != db.user_id)
    ("delivery", "create_delivery_order", dict(D, user_id=1), "Error: User ID does not match"),
    # create_delivery_order: `assert user_id, "User ID cannot be empty"`
    ("delivery", "create_delivery_order", dict(D, user_id=0), "Error: User ID cannot be empty"),
    # create_delivery_order: `assert store_id in self.db.stores, f"Store {store_id} not found"`
    ("delivery", "create_delivery_order", dict(D, store_id=5), "Error: Store 5 not found"),
    # create_delivery_order: `assert dispatch_time and check_time_format(dispatch_time), ...`
    ("delivery", "create_delivery_order", dict(D, dispatch_time=20250621), "Error: strptime() argument 1 must be str, not int"),
    ("delivery", "create_delivery_order", dict(D, dispatch_time=0),
     "Error: dispatch_time 0 time format is invalid, yyyy-mm-dd HH:MM:SS required"),
    # create_delivery_order: `self.address_to_longitude_latitude(address)` -> rerank
    ("delivery", "create_delivery_order", dict(D, address=5), "Error: sentence must be a String"),
    # create_delivery_order: `for i, attr in enumerate(attributes[:len(products)])`
    ("delivery", "create_delivery_order", dict(D, attributes=5), "Error: 'int' object is not subscriptable"),
    # ... then `StoreProduct(..., attributes=attr)`: `attributes: Union[str, List]`
    ("delivery", "create_delivery_order", dict(D, attributes=[1]),
     "Error: 2 validation errors for StoreProduct\nattributes.str\n  Input should be a valid string [type=string_type, "
     "input_value=1, input_type=int]\nattributes.list[any]\n  Input should be a valid list [type=list_type, "
     "input_value=1, input_type=int]"),
    # create_delivery_order: `Order(..., note=note, ...)`: `note: Optional[str]`
    ("delivery", "create_delivery_order", dict(D, note=5),
     "Error: 1 validation error for Order\nnote\n  Input should be a valid string [type=string_type, input_value=5, input_type=int]"),
    # _get_delivery_order: `if order_id not in self.db.orders: raise ValueError(f"Order {order_id} not found")`
    ("delivery", "pay_delivery_order", dict(order_id=5), "Error: Order 5 not found"),
    ("delivery", "cancel_delivery_order", dict(order_id=["OT1"]), "Error: unhashable type: 'list'"),
    # search_delivery_orders: `order.status == status` is simply never true
    ("delivery", "search_delivery_orders", dict(user_id="U000001", status=5), "No delivery orders available"),
    # get_delivery_order_detail: `assert order_id, "Order ID cannot be empty"`
    ("delivery", "get_delivery_order_detail", dict(order_id=0), "Error: Order ID cannot be empty"),
    # --- in-store (domains/instore/tools.py, InStoreTools) ---
    # instore_shop_search_recommend / instore_product_search_recommend: `rerank("".join(keywords), ...)`
    ("instore", "instore_shop_search_recommend", dict(keywords=[1]), "Error: sequence item 0: expected str instance, int found"),
    # create_instore_product_order: `assert quantity > 0, "Quantity must be greater than 0"`
    ("instore", "create_instore_product_order", dict(I, product_id="S17564420247526245_P00006", quantity="2"),
     "Error: '>' not supported between instances of 'str' and 'int'"),
    # create_instore_product_order: `assert product_id in [product.product_id for ...], "Product does not exist"`
    ("instore", "create_instore_product_order", dict(I, product_id=5), "Error: Product does not exist"),
    # create_instore_product_order: `assert shop_id in self.db.shops, "Shop does not exist"`
    ("instore", "create_instore_product_order", dict(I, shop_id=["S17564420247526245_I00002"], product_id="x"),
     "Error: unhashable type: 'list'"),
    # _get_instore_order: `raise ValueError(f"Order {order_id} not found")`; pay_instore_order: `assert order_id`
    ("instore", "pay_instore_order", dict(order_id=5), "Error: Order 5 not found"),
    ("instore", "pay_instore_order", dict(order_id=0), "Error: Order ID cannot be empty"),
    # instore_book: `assert customer_count > 0, ...`
    ("instore", "instore_book", dict(I, time=I_T, customer_count="2"), "Error: '>' not supported between instances of 'str' and 'int'"),
    # instore_book: `BookInfo(..., customer_count=customer_count, ...)`: `customer_count: int`
    ("instore", "instore_book", dict(I, time=I_T, customer_count=1.5),
     "Error: 1 validation error for BookInfo\ncustomer_count\n  " + PYD_INT),
    # instore_book: `assert time, "Table booking time cannot be empty"`, then `assert check_time_format(time, ...)`
    ("instore", "instore_book", dict(I, time=0), "Error: Table booking time cannot be empty"),
    ("instore", "instore_book", dict(I, time=5), "Error: strptime() argument 1 must be str, not int"),
    # _get_book_info: `raise ValueError(f"BookInfo {book_id} not found")`; pay_instore_book: `assert book_id, ...`
    ("instore", "pay_instore_book", dict(book_id=5), "Error: BookInfo 5 not found"),
    ("instore", "instore_cancel_book", dict(book_id=0), "Error: Booking ID cannot be empty"),
    # instore_reservation: `assert check_time_format(time, ...)` (no emptiness check first), `assert customer_count > 0`
    ("instore", "instore_reservation", dict(I, time=0), "Error: strptime() argument 1 must be str, not int"),
    ("instore", "instore_reservation", dict(I, time=I_T, customer_count="2"),
     "Error: '>' not supported between instances of 'str' and 'int'"),
    # instore_reservation: `ReservationInfo(..., customer_count=customer_count, ...)`
    ("instore", "instore_reservation", dict(I, time=I_T, customer_count=1.5),
     "Error: 1 validation error for ReservationInfo\ncustomer_count\n  " + PYD_INT),
    # _get_reservation_info: `raise ValueError(f"ReservationInfo {reservation_id} not found")`
    ("instore", "instore_modify_reservation", dict(reservation_id=5, time=I_T), "Error: ReservationInfo 5 not found"),
    ("instore", "instore_cancel_reservation", dict(reservation_id=0), "Error: Reservation ID cannot be empty"),
    # get_instore_orders / get_instore_reservations / get_instore_books: `assert self._check_user(user_id), ...`
    ("instore", "get_instore_books", dict(user_id=5), "Error: User ID does not match"),
    # search_instore_book: `book = self._get_book_info(book_id)`
    ("instore", "search_instore_book", dict(user_id="U216378", book_id=5), "Error: BookInfo 5 not found"),
]


@pytest.fixture(scope="module")
def type_envs(tasks):
    return {"delivery": tasks[("delivery", "en")][0], "instore": tasks[("instore", "en")][1]}


@pytest.mark.parametrize("domain,name,args,want", UPSTREAM_TYPES,
                         ids=[f"{r[1]}-{i}" for i, r in enumerate(UPSTREAM_TYPES)])
def test_wrong_types_answered_as_upstream(type_envs, domain, name, args, want):
    task = type_envs[domain]
    env = vita.make_env(task)
    if name == "create_delivery_order":
        args = {"address": task.metadata["environment"]["location"][0]["address"], **args}
    assert env.step(name, copy.deepcopy(args)) == want
    assert env.db["orders"] == vita.make_env(task).db["orders"]      # no order created


def test_wrong_types_upstream_accepts(type_envs):
    """Where upstream silently accepts a wrongly typed value, the write goes through with what upstream stores."""
    d, i = type_envs["delivery"], type_envs["instore"]
    addr = d.metadata["environment"]["location"][0]["address"]
    env = vita.make_env(d)
    # StoreProduct(quantity=cnt): pydantic's lax int turns 2.0 into 2 and True into 1; total = price * cnt
    o = json.loads(env.step("create_delivery_order", dict(D, address=addr, product_cnts=[2.0])))
    assert o["products"][0]["quantity"] == 2 and o["total_price"] == 50
    o = json.loads(env.step("create_delivery_order", dict(D, address=addr, product_cnts=[True])))
    assert o["products"][0]["quantity"] == 1 and o["total_price"] == 25
    # attributes[:len(products)] on a string slices it: the first product gets its first letter
    o = json.loads(env.step("create_delivery_order", dict(D, address=addr, attributes="spicy")))
    assert o["products"][0]["attributes"] == "s"
    # modify_delivery_order: `order.note = note` (assignment, not validated)
    assert env.step("modify_delivery_order", {"order_id": o["order_id"], "note": 5}) == f"Order {o['order_id']} has been modified."
    assert json.loads(env.step("get_delivery_order_detail", {"order_id": o["order_id"]}))["note"] == 5
    env = vita.make_env(i)
    pid = "S17564420247526245_P00006"     # price 188
    # create_instore_product_order: `product.quantity = quantity` (not validated), total_price = quantity * price
    o = json.loads(env.step("create_instore_product_order", dict(I, product_id=pid, quantity=1.5)))
    assert o["products"][0]["quantity"] == 1.5 and o["total_price"] == 282.0
    # BookInfo / ReservationInfo(customer_count: int): 2.0 -> 2, True -> 1
    assert json.loads(env.step("instore_book", dict(I, time=I_T, customer_count=2.0)))["customer_count"] == 2
    r = json.loads(env.step("instore_reservation", dict(I, time=I_T, customer_count=True)))
    assert r["customer_count"] == 1
    # instore_modify_reservation: `reservation_info.customer_count = customer_count` (assignment): 1.5 is kept
    assert json.loads(env.step("instore_modify_reservation", {"reservation_id": r["reservation_id"], "time": I_T,
                                                             "customer_count": 1.5}))["customer_count"] == 1.5
    # ... and `customer_count >= 0` on a string raises
    assert env.step("instore_modify_reservation", {"reservation_id": r["reservation_id"], "time": I_T,
                                                  "customer_count": "3"}) == \
        "Error: '>=' not supported between instances of 'str' and 'int'"
    # the search tools rank on "".join(keywords): a bare string is the same query as a one-element list
    env = vita.make_env(d)
    assert env.step("delivery_store_search_recommand", {"keywords": "rice noodles"}) == \
        env.step("delivery_store_search_recommand", {"keywords": ["rice noodles"]})


def test_tool_semantics(tasks):
    t = tasks[("delivery", "en")][0]
    env = vita.make_env(t)
    sid, pid = "S85277471199200385_S98778", "S26110520013660896_P88296"
    addr = t.metadata["environment"]["location"][0]["address"]
    assert "Jintugo" in env.step("delivery_store_search_recommand", {"keywords": ["rice noodles"]}).splitlines()[0]
    assert json.loads(env.step("get_delivery_product_info", {"product_id": pid}))["price"] == 25
    assert env.step("weather", {"address": "Kunming", "date_start": "2025-06-21", "date_end": "2025-06-21"}).count("rainy") == 1
    assert json.loads(env.step("address_to_longitude_latitude", {"address": addr})) == [102.713518, 25.048244]
    assert env.step("get_holiday_date", {"year": "2025", "holiday_name": "Mid-Autumn Festival"}) == "2025-10-06"
    assert env.step("get_date_holiday_info", {"date": "2025-10-03"}) == "National Day"
    past = env.step("create_delivery_order", {"user_id": "U000001", "store_id": sid, "product_ids": [pid],
                                              "product_cnts": [1], "address": addr, "dispatch_time": "2025-06-21 10:00:00"})
    assert past.startswith("Error") and "future" in past
    wrong_user = env.step("create_delivery_order", {"user_id": "U9", "store_id": sid, "product_ids": [pid],
                                                    "product_cnts": [1], "address": addr, "dispatch_time": "2025-06-21 11:30:00"})
    assert "does not match" in wrong_user
    order = json.loads(env.step("create_delivery_order", {"user_id": "U000001", "store_id": sid, "product_ids": [pid],
                                                          "product_cnts": [2], "address": addr,
                                                          "dispatch_time": "2025-06-21 11:30:00"}))
    assert order["status"] == "unpaid" and order["total_price"] == 50 and order["shipping_time"] > 25
    oid = order["order_id"]
    assert env.step("pay_delivery_order", {"order_id": oid}) == "Payment successful"
    assert "not in `unpaid`" in env.step("pay_delivery_order", {"order_id": oid})
    assert env.step("get_delivery_order_status", {"order_id": oid}) == "paid"
    assert "cancelled" in env.step("cancel_delivery_order", {"order_id": oid})
    assert env.step("cancel_delivery_order", {"order_id": oid}).startswith("Error")
    assert env.step("pay_delivery_order", {"order_id": "OTnope"}).startswith("Error")
    # deterministic ids: a fresh env creates the same id
    env2 = vita.make_env(t)
    again = json.loads(env2.step("create_delivery_order", {"user_id": "U000001", "store_id": sid, "product_ids": [pid],
                                                           "product_cnts": [2], "address": addr,
                                                           "dispatch_time": "2025-06-21 11:30:00"}))
    assert again["order_id"] == oid


def test_rehearsed_ids_are_aliased(tasks):
    t = tasks[("delivery", "en")][0]
    calls, _ = vita.reference_calls(t)
    i = _first_create(calls, "create_delivery_order")
    invented = "OTdeadbeef00"
    calls = copy.deepcopy(calls)
    calls[i + 1].arguments["order_id"] = invented        # the pay call uses the id the policy made up
    obs = [""] * len(calls)
    obs[i] = json.dumps({"order_id": invented, "status": "unpaid"})
    assert vita.score(t, _traj(t, calls, obs)).reward == 1.0
    assert vita.score(t, _traj(t, calls)).reward == pytest.approx(0.75)   # without the observation: not paid


def test_user_turn_and_judge(tasks):
    t = tasks[("delivery", "en")][0]
    assert vita.make_env(t).user_turn("Done.") is None
    env = vita.make_env(t, user_fn=lambda text, task: f"ok ({task.metadata['raw_id']})")
    assert env.user_turn("Shall I pay?") == "ok (10711001)"
    assert env.user_turn("All done ###STOP###") is None
    calls, _ = vita.reference_calls(t)
    n = len(t.ground_truth["rubrics"])
    seen = {}

    def judge(rubrics, messages, state):
        seen["state"] = state
        return [True] * len(rubrics)
    s = vita.score(t, _traj(t, calls), judge_fn=judge)
    assert s.reward == 1.0 and s.components["rubric_score"] == 1.0 and len(seen["state"]["orders"]) == 1
    s = vita.score(t, _traj(t, calls), judge_fn=lambda r, m, st: [True] * (n - 1) + [False])
    assert s.reward == 0.0 and s.components["proxy_reward"] == 1.0
