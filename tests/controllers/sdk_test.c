/* Test controller for SDK pieces, built by tests/controllers with controllers/build.py --extra.
 * controller_arg selects a test; results are printed as one JSON line to stdout (the call's logs):
 *   {"op":"regex","pattern":p,"inputs":[s...]}  -> {"ok":true,"matches":[bool...],"viable":[bool...]} | {"ok":false,"error":e}
 *   {"op":"json","docs":[text...]}              -> {"results":[<re-serialization as a JSON string> | null (invalid)...]}
 *   {"op":"mask","pattern":p,"prefix":s}        -> mid_process returns the trie-walked mask of the regex recognizer
 *                                                  after `prefix`; logs {"top":state,"accepting":bool}
 *   {"op":"vars"}                               -> exercises set/append/get, logs what get returned
 *   {"op":"get","doc":text,"keys":[k...]}       -> {"values":[<re-serialization string> | null...]} via aici_json_get
 *   {"op":"oom"}                                -> allocates 1 MiB blocks until the memory limit
 *   {"op":"declare","calls":[[h,mid,n]...]}     -> {"flags":[u32...]}: the I/O area's flags word after each
 *                                                  aici_declare_constraint(h, mid, n) ([h]: aici_mid_from_constraint(h))
 */
#include "aici.h"

static aici_json arg;
static char *arg_text;
static aici_regex *rx;
static aici_stack_recognizer rec;

static void out(aici_buf *b) {
    aici_buf_putc(b, '\n');
    aici_log(b->p, b->n);
    aici_buf_free(b);
}

static char *field(const char *key, uint32_t *n) {
    aici_json v;
    return aici_json_get(arg, key, &v) ? aici_json_str(v, n) : NULL;
}

static void dump(aici_buf *b, aici_json v) {
    aici_json_iter it = {0};
    aici_json k, e;
    int64_t i;
    uint32_t n;
    int first = 1;
    switch (aici_json_type(v)) {
    case AICI_J_OBJECT:
        aici_buf_putc(b, '{');
        while (aici_json_next(v, &it, &k, &e)) {
            if (!first) aici_buf_putc(b, ',');
            first = 0;
            char *s = aici_json_str(k, &n);
            aici_json_put_str(b, s, n);
            free(s);
            aici_buf_putc(b, ':');
            dump(b, e);
        }
        aici_buf_putc(b, '}');
        break;
    case AICI_J_ARRAY:
        aici_buf_putc(b, '[');
        while (aici_json_next(v, &it, NULL, &e)) {
            if (!first) aici_buf_putc(b, ',');
            first = 0;
            dump(b, e);
        }
        aici_buf_putc(b, ']');
        break;
    case AICI_J_STRING: {
        char *s = aici_json_str(v, &n);
        aici_json_put_str(b, s, n);
        free(s);
        break;
    }
    case AICI_J_NUMBER:
        if (aici_json_int(v, &i)) aici_buf_i64(b, i);
        else aici_buf_put(b, v.p, v.n);   /* fractions/exponents/huge: echoed */
        break;
    default:
        aici_buf_put(b, v.p, v.n);
    }
}

static void test_regex(void) {
    uint32_t pn;
    char *pat = field("pattern", &pn);
    const char *err = "";
    aici_buf b = {0};
    aici_regex *r = aici_regex_new(pat, pn, &err);
    if (!r) {
        aici_buf_puts(&b, "{\"ok\":false,\"error\":");
        aici_json_put_str(&b, err, strlen(err));
        aici_buf_putc(&b, '}');
        return out(&b);
    }
    aici_json inputs, s;
    aici_json_get(arg, "inputs", &inputs);
    aici_buf m = {0}, via = {0};
    aici_json_iter it = {0};
    while (aici_json_next(inputs, &it, NULL, &s)) {
        uint32_t n;
        char *str = aici_json_str(s, &n);
        aici_buf_puts(&m, m.n ? ",": "");
        aici_buf_puts(&m, aici_regex_matches(r, str, n) ? "true" : "false");
        uint32_t st = aici_regex_initial(r), i = 0;
        while (i < n && aici_regex_step(r, st, (uint8_t)str[i], &st)) i++;
        aici_buf_puts(&via, via.n ? ",": "");
        aici_buf_puts(&via, i == n ? "true" : "false");
        free(str);
    }
    aici_buf_puts(&b, "{\"ok\":true,\"matches\":[");
    if (m.n) aici_buf_put(&b, m.p, m.n);
    aici_buf_puts(&b, "],\"viable\":[");
    if (via.n) aici_buf_put(&b, via.p, via.n);
    aici_buf_puts(&b, "]}");
    aici_buf_free(&m);
    aici_buf_free(&via);
    out(&b);
}

/* Appends v dumped (as a JSON string) when found, else null. */
static void put_dumped(aici_buf *b, int found, const aici_json *v) {
    if (!found) {
        aici_buf_puts(b, "null");
        return;
    }
    aici_buf one = {0};
    dump(&one, *v);
    aici_json_put_str(b, one.p, one.n);
    aici_buf_free(&one);
}

static void test_json(void) {
    aici_json docs, d, v;
    aici_json_get(arg, "docs", &docs);
    aici_buf b = {0};
    aici_buf_puts(&b, "{\"results\":[");
    aici_json_iter it = {0};
    int first = 1;
    while (aici_json_next(docs, &it, NULL, &d)) {
        uint32_t n;
        char *text = aici_json_str(d, &n);
        if (!first) aici_buf_putc(&b, ',');
        first = 0;
        put_dumped(&b, aici_json_parse(text, n, &v), &v);
        free(text);
    }
    aici_buf_puts(&b, "]}");
    out(&b);
}

static void test_mask_init(void) {
    uint32_t pn, xn;
    char *pat = field("pattern", &pn);
    char *prefix = field("prefix", &xn);
    const char *err;
    rx = aici_regex_new(pat, pn, &err);
    aici_stack_recognizer_init(&rec, aici_regex_functional(rx));
    for (uint32_t i = 0; i < xn; i++) rec.base.vt->try_push_byte(&rec.base, (uint8_t)prefix[i]);
    rec.base.vt->collapse(&rec.base);
    aici_buf b = {0};
    aici_buf_puts(&b, "{\"top\":");
    aici_buf_u64(&b, aici_stack_top(&rec));
    aici_buf_puts(&b, aici_regex_accepting(rx, aici_stack_top(&rec)) ? ",\"accepting\":true}" : ",\"accepting\":false}");
    out(&b);
}

static void test_vars(void) {
    aici_buf b = {0};
    uint64_t v1 = aici_var_set("x", "he\"l\0lo", 7);
    uint64_t v2 = aici_var_append("x", "\xff!", 2);
    uint32_t n = 0;
    uint64_t ver = 0;
    char *val = aici_var_get("x", &n, &ver);
    char *missing = aici_var_get("nope", NULL, NULL);
    aici_buf_puts(&b, "{\"v1\":");
    aici_buf_u64(&b, v1);
    aici_buf_puts(&b, ",\"v2\":");
    aici_buf_u64(&b, v2);
    aici_buf_puts(&b, ",\"version\":");
    aici_buf_u64(&b, ver);
    aici_buf_puts(&b, ",\"hex\":\"");
    for (uint32_t i = 0; i < n; i++) {
        static const char hx[] = "0123456789abcdef";
        aici_buf_putc(&b, hx[(uint8_t)val[i] >> 4]);
        aici_buf_putc(&b, hx[val[i] & 15]);
    }
    aici_buf_puts(&b, missing ? "\",\"missing\":false}" : "\",\"missing\":true}");
    out(&b);
}

static void test_get(void) {
    uint32_t n;
    char *doc = field("doc", &n);
    aici_json obj, keys, k, v;
    aici_buf b = {0};
    aici_buf_puts(&b, "{\"values\":[");
    if (aici_json_parse(doc, n, &obj) && aici_json_get(arg, "keys", &keys)) {
        aici_json_iter it = {0};
        int first = 1;
        while (aici_json_next(keys, &it, NULL, &k)) {
            char *key = aici_json_str(k, NULL);
            if (!first) aici_buf_putc(&b, ',');
            first = 0;
            put_dumped(&b, aici_json_get(obj, key, &v), &v);
            free(key);
        }
    }
    aici_buf_puts(&b, "]}");
    out(&b);
}

/* Each of "numbers" read as a double and written back with 6 decimals (null: not a number). */
static void test_f64(void) {
    aici_json numbers, v;
    aici_json_get(arg, "numbers", &numbers);
    aici_buf b = {0};
    aici_buf_puts(&b, "{\"values\":[");
    aici_json_iter it = {0};
    for (int first = 1; aici_json_next(numbers, &it, NULL, &v); first = 0) {
        double d;
        if (!first) aici_buf_putc(&b, ',');
        if (aici_json_f64(v, &d)) aici_buf_f64(&b, d);
        else aici_buf_puts(&b, "null");
    }
    aici_buf_puts(&b, "]}");
    out(&b);
}

static void test_oom(void) {
    for (uint32_t i = 0;; i++) {
        char *p = malloc(1 << 20);
        p[i & 0xFFFF] = 1;
    }
}

uint32_t tiller_io(void);   /* the SDK's export: the I/O area's offset (its flags word follows cap) */

static void test_declare(void) {
    aici_json calls, call, v;
    aici_json_iter it = {0};
    aici_buf b = {0};
    aici_buf_puts(&b, "{\"flags\":[");
    aici_json_get(arg, "calls", &calls);
    for (int first = 1; aici_json_next(calls, &it, NULL, &call); first = 0) {
        int64_t h = 0, mid = 0, tokens = 0;
        aici_json_iter at = {0};
        int k = 0;
        while (aici_json_next(call, &at, NULL, &v)) aici_json_int(v, k == 0 ? &h : k == 1 ? &mid : &tokens), k++;
        if (k == 1) aici_mid_from_constraint((int32_t)h);
        else aici_declare_constraint((int32_t)h, (int)mid, (uint32_t)tokens);
        if (!first) aici_buf_putc(&b, ',');
        aici_buf_u64(&b, ((const uint32_t *)tiller_io())[1]);
    }
    aici_buf_puts(&b, "]}");
    out(&b);
}

static void init_prompt(const uint32_t *prompt, uint32_t n) {
    uint32_t len;
    aici_json op;
    arg_text = (char *)aici_read_blob(aici_host_module_arg(), &len);
    if (!aici_json_parse(arg_text, len, &arg) || !aici_json_get(arg, "op", &op)) aici_host_stop();
    if (aici_json_str_eq(op, "regex")) test_regex();
    else if (aici_json_str_eq(op, "json")) test_json();
    else if (aici_json_str_eq(op, "mask")) test_mask_init();
    else if (aici_json_str_eq(op, "vars")) test_vars();
    else if (aici_json_str_eq(op, "get")) test_get();
    else if (aici_json_str_eq(op, "f64")) test_f64();
    else if (aici_json_str_eq(op, "oom")) test_oom();
    else if (aici_json_str_eq(op, "declare")) test_declare();
}

static aici_mid_result mid_process(const uint32_t *fork_group, uint32_t n) {
    if (!rx) return aici_mid_stop();
    uint32_t *mask = aici_mask_new();
    aici_compute_mask(&rec.base, mask);
    aici_return_mask(mask);
    free(mask);
    return aici_mid_sample();
}

static const aici_ctrl ctrl = {init_prompt, NULL, mid_process, NULL};
const aici_ctrl *aici_controller(void) { return &ctrl; }
