async def test_chat_smoke(gw):
    tid, key = await gw.make_tenant()
    r = await gw.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": gw.runtime.engine.model_name, "max_tokens": 5,
                                   "messages": [{"role": "user", "content": "hello"}]})
    print(r.status_code, r.headers, r.text)
    assert r.status_code == 200
